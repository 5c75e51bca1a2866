"""RABO / RAFBO hypergradients on a bilevel problem with closed-form y*(x) and grad Phi(x).

    g(x, y) = 1/2 y^T A y - y^T B phi(x),   phi(x) = x + x^2 / 2 (elementwise),   A positive definite
    f(x, y) = 1/2 ||y - t||^2 + 1/2 x^T R x + (sum_j x_j)(sum_k y_k)

so y*(x) = A^-1 B phi(x) and grad Phi(x) = grad_x f + phi'(x) (.) B^T A^-1 grad_y f at y*(x). g is
quadratic in y (and in y and phi(x)); phi's curvature makes y* nonlinear in x, so a finite
difference of y* has an O(mu) error (with phi linear it would be exact for every mu).

Prepare / Execute / Assert. The implicit hypergradient (eq. (7), CG and Neumann) must match to
1e-5; the coordinate finite differences of Algorithm 2 must approach it as mu shrinks. Two
unfaithful variants fail: the first-order estimate (grad_x f alone) and Algorithm 2's gradient
difference taken without the -beta that makes it an estimate of d y* / d x.
"""

from __future__ import annotations

import pytest
import torch

from fedtune.methods.rabo.hypergrad import (
    conjugate_gradient,
    finite_difference_hypergradient,
    implicit_hypergradient,
)
from fedtune.models.bilevel import gradient_steps

D1, D2 = 5, 4


@pytest.fixture(scope="module")
def quad():
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    m = r(D2, D2)
    A = m @ m.T + D2 * torch.eye(D2, dtype=torch.float64)
    B, t, R, x0 = r(D2, D1), r(D2), r(D1, D1), 0.5 * r(D1)
    R = 0.1 * (R + R.T)

    def phi(x):
        return x + 0.5 * x**2

    def g(x, y):
        return 0.5 * y[0] @ A @ y[0] - y[0] @ (B @ phi(x[0]))

    def f(x, y):
        return 0.5 * ((y[0] - t) ** 2).sum() + 0.5 * x[0] @ R @ x[0] + x[0].sum() * y[0].sum()

    def y_star(x):
        return torch.linalg.solve(A, B @ phi(x))

    def grad_phi(x):
        y = y_star(x)
        gy = (y - t) + x.sum()
        gx = R @ x + y.sum() * torch.ones_like(x)
        return gx + (1 + x) * (B.T @ torch.linalg.solve(A, gy))

    return dict(A=A, g=g, f=f, y_star=y_star, grad_phi=grad_phi, x0=x0)


def leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("solver,iters", [("cg", 50), ("neumann", 600)])
def test_implicit_hypergradient_matches_closed_form(quad, solver, iters):
    # Prepare: y at the inner optimum y*(x0)
    x0 = quad["x0"]
    x, y = leaves(x0), leaves(quad["y_star"](x0))
    lr = 1.0 / torch.linalg.eigvalsh(quad["A"]).max().item()  # Neumann converges for lr < 2 / lambda_max
    # Execute
    hyper, value = implicit_hypergradient(quad["g"], quad["f"], x, y, solver=solver, iters=iters, neumann_lr=lr)
    # Assert
    assert torch.allclose(hyper[0], quad["grad_phi"](x0), atol=1e-5, rtol=0)
    assert value == pytest.approx(float(quad["f"]([x0], [quad["y_star"](x0)])))


def test_first_order_estimate_fails_the_closed_form(quad):
    """Unfaithful RABO variant: dropping eq. (7)'s implicit term (grad_x f alone)."""
    x0 = quad["x0"]
    x, y = leaves(x0), leaves(quad["y_star"](x0))
    first_order = torch.autograd.grad(quad["f"](x, y), x)[0]
    assert not torch.allclose(first_order, quad["grad_phi"](x0), atol=1e-5, rtol=0)


def converged_inner(quad, steps=300, lr=0.05):
    """y_hat(x): plain gradient steps on g from 0 (Algorithm 1's inner loop, run to convergence)."""
    return lambda x: gradient_steps(quad["g"], x, [torch.zeros(D2, dtype=torch.float64)], steps, lr)


def fd_errors(quad, inner_solve, mus):
    x0 = quad["x0"]
    coords = [(0, j) for j in range(D1)]  # P = every coordinate
    errors = []
    for mu in mus:
        hyper, _ = finite_difference_hypergradient(quad["f"], inner_solve, [x0], [quad["y_star"](x0)], coords, mu)
        errors.append((hyper[0] - quad["grad_phi"](x0)).abs().max().item())
    return errors


def test_finite_difference_hypergradient_error_shrinks_with_mu(quad):
    mus = [1e-1, 1e-2, 1e-3, 1e-4]
    errors = fd_errors(quad, converged_inner(quad), mus)
    assert all(b < a / 5 for a, b in zip(errors, errors[1:])), errors  # O(mu)
    for mu, err in zip(mus, errors):
        assert err < 2.0 * mu, (mu, err)


def test_literal_gradient_difference_does_not_approach_the_hypergradient(quad):
    """Algorithm 2's delta = (grad_y g(x + mu e_p, y) - grad_y g(x, y)) / mu used as J e_p without the
    -beta of one inner step: its error stays O(1) however small mu is."""
    y_fixed = quad["y_star"](quad["x0"])

    def gradient_as_solution(x):  # so that (solve(x + mu e) - solve(x)) / mu = delta
        with torch.enable_grad():
            y = y_fixed.clone().requires_grad_()
            return [torch.autograd.grad(quad["g"](x, [y]), y)[0]]

    errors = fd_errors(quad, gradient_as_solution, [1e-2, 1e-3, 1e-4])
    assert min(errors) > 0.1, errors


def test_conjugate_gradient_stops_at_negative_curvature():
    h = torch.diag(torch.tensor([2.0, -1.0], dtype=torch.float64))
    v = conjugate_gradient(lambda p: [h @ p[0]], [torch.tensor([1.0, 1.0], dtype=torch.float64)], iters=10)
    assert torch.isfinite(v[0]).all() and v[0].abs().max() < 10
