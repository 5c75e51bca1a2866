"""Hypergradients of a bilevel problem min_x f(x, y*(x)), y*(x) = argmin_y g(x, y), from
Hessian-vector products (never an explicit Hessian) or from finite differences.

Every routine takes the outer variables ``x`` and inner variables ``y`` as lists of tensors and
the losses as closures ``g(x, y)``, ``f(x, y)`` -> scalar tensors (the batches bound inside).

- :func:`implicit_hypergradient`, RABO eq. (7) (AID): grad_x f - grad^2_xy g v with
  v = [grad^2_yy g]^-1 grad_y f solved by conjugate gradient (:func:`conjugate_gradient`) or a
  Neumann series (:func:`neumann_series`, FedNest's ``neumann_hyperstep_preconditioner``). The
  Hessian-vector products are double backward passes through ``grad_y g`` w.r.t. ``y`` only, so a
  few-shot head's products never go back through the backbone.
- :func:`finite_difference_hypergradient`, RAFBO Algorithm 2 / eq. (10): second-order free.
  For each coordinate e_p of a sampled set P of x, the Jacobian column J* e_p = d y*/d x_p is
  estimated by the deterministic coordinate difference (y_hat(x + mu e_p) - y_hat(x)) / mu, where
  y_hat(.) is the client's inner solver (gradient steps on g from a fixed start, Sow et al. 2022,
  the paper's reference [26]); the estimate is grad_x f + sum_{p in P} <J e_p, grad_y f> e_p
  (eq. (9) restricted to P). With one inner step from y, y_hat(x') = y - beta grad_y g(x', y), so
  J e_p = -beta delta(x, e_p): Algorithm 2's gradient difference delta, with the factor -beta that
  makes it an estimate of d y*/d x_p (taken without it, the sum has the wrong sign and scale and
  does not approach grad Phi as mu -> 0; ``tests/test_rabo_hypergrad.py`` shows both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedtune.models.bilevel import Loss

Tensors = list[torch.Tensor]


def second_order_kernels():
    """A context in which attention has a second derivative: scaled-dot-product attention on the
    math kernel (the fused CPU kernels have no double backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.as_tensor(sum((u * v).sum() for u, v in zip(a, b)))  # a tensor itself (0 for no pairs)


def _grads(out: torch.Tensor | Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], **kw) -> Tensors:
    got = torch.autograd.grad(out, list(inputs), allow_unused=True, **kw)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, inputs)]


def conjugate_gradient(hvp: Callable[[Tensors], Tensors], b: Tensors, iters: int, tol: float = 1e-10) -> Tensors:
    """Solve H v = b for symmetric positive definite H given only v -> H v (at most ``iters``
    products; stops when ||r||^2 <= tol * ||b||^2, and, as truncated CG does on a Hessian that is
    not positive definite (a deep inner model), at a direction of non-positive curvature)."""
    v = [torch.zeros_like(t) for t in b]
    r = [t.clone() for t in b]
    p = [t.clone() for t in b]
    rr = _dot(r, r)
    stop = tol * rr
    for _ in range(iters):
        if rr <= stop or rr == 0:
            break
        hp = hvp(p)
        curvature = _dot(p, hp)
        if curvature <= 0:
            break
        alpha = rr / curvature
        v = [a + alpha * d for a, d in zip(v, p)]
        r = [a - alpha * d for a, d in zip(r, hp)]
        rr_new = _dot(r, r)
        p = [a + (rr_new / rr) * d for a, d in zip(r, p)]
        rr = rr_new
    return v


def neumann_series(hvp: Callable[[Tensors], Tensors], b: Tensors, terms: int, lr: float) -> Tensors:
    """v = lr * sum_{k=0}^{terms} (I - lr H)^k b, the truncated Neumann series of H^-1 b
    (converges when 0 < lr < 2 / lambda_max(H))."""
    term = [t.clone() for t in b]
    total = [t.clone() for t in b]
    for _ in range(terms):
        hp = hvp(term)
        term = [a - lr * h for a, h in zip(term, hp)]
        total = [a + t for a, t in zip(total, term)]
    return [lr * t for t in total]


def implicit_hypergradient(
    g: Loss,
    f: Loss,
    x: Sequence[torch.Tensor],
    y: Sequence[torch.Tensor],
    *,
    solver: str = "cg",
    iters: int = 20,
    tol: float = 1e-10,
    neumann_lr: float = 0.1,
    y_mask: Sequence[torch.Tensor] | None = None,
) -> tuple[Tensors, float]:
    """(grad_x f(x, y) - grad^2_xy g(x, y) [grad^2_yy g(x, y)]^-1 grad_y f(x, y), f(x, y)) (RABO
    eq. (7)), ``x`` and ``y`` leaf tensors requiring grad. ``y_mask``: solve in the sub-space of
    the kept entries of y (m (.) H (m (.) v), for zero-masked full-size tensors)."""
    fx = f(x, y)
    grad_fx = _grads(fx, [*x, *y])
    gx_f, gy_f = grad_fx[: len(x)], grad_fx[len(x) :]
    gy_g = torch.autograd.grad(g(x, y), list(y), create_graph=True)

    def hvp(v: Tensors) -> Tensors:
        if y_mask is not None:
            v = [a * m for a, m in zip(v, y_mask)]
        out = [h.detach() for h in _grads(gy_g, y, grad_outputs=v, retain_graph=True)]
        return out if y_mask is None else [a * m for a, m in zip(out, y_mask)]

    b = [t.detach() for t in gy_f]
    if y_mask is not None:
        b = [a * m for a, m in zip(b, y_mask)]
    v = conjugate_gradient(hvp, b, iters, tol) if solver == "cg" else neumann_series(hvp, b, iters, neumann_lr)
    cross = _grads(gy_g, x, grad_outputs=v)  # grad^2_xy g v: one more backward, through x
    return [a.detach() - c.detach() for a, c in zip(gx_f, cross)], float(fx.detach())


def finite_difference_hypergradient(
    f: Loss,
    inner_solve: Callable[[Sequence[torch.Tensor]], Tensors],
    x: Sequence[torch.Tensor],
    y: Sequence[torch.Tensor],
    coordinates: Sequence[tuple[int, int]],
    mu: float,
) -> tuple[Tensors, float]:
    """(RAFBO's estimate (Algorithm 2, eq. (10)): grad_x f(x, y) + sum_{p in P} <J e_p, grad_y f(x, y)> e_p
    with J e_p = (inner_solve(x + mu e_p) - inner_solve(x)) / mu; ``coordinates`` lists P as
    (tensor index into x, flat index), f(x, y)). ``inner_solve(x)`` returns y_hat(x) (no graph
    needed)."""
    xs = [t.detach().requires_grad_() for t in x]
    ys = [t.detach().requires_grad_() for t in y]
    fx = f(xs, ys)
    grads = _grads(fx, [*xs, *ys])
    out = [gr.detach().clone() for gr in grads[: len(xs)]]
    gy_f = [gr.detach() for gr in grads[len(xs) :]]
    base = [t.detach() for t in x]
    with torch.no_grad():
        y0 = inner_solve(base)
        for ti, j in coordinates:
            shifted = [t.clone() if k == ti else t for k, t in enumerate(base)]
            shifted[ti].view(-1)[j] += mu
            yp = inner_solve(shifted)
            column = [(a - b) / mu for a, b in zip(yp, y0)]  # J e_p, the shape of y
            out[ti].view(-1)[j] += _dot(column, gy_f)
    return out, float(fx.detach())
