"""What a client of capacity beta costs in the sub-model methods (RABO / RAFBO, Static, FedRolex,
FIARSE), predicted from the task's model sliced to that capacity.

A capacity beta (``profile.capacity``) is RABO's resource-adaptive mask M(., R_i) (eq. (3)) made
concrete as HeteroFL's model rate: ceil(beta n) units of every unit group of n
(:func:`~fedtune.models.structure.units_kept`), so the planner's ladder is the paper's settings
beta in {1, 1/2, 1/4, 1/8, 1/16} (Sec. V-A). Each capacity's sub-model is built as the static
policy's (every policy keeps the same number of units, so the costs are the same), and

- **peak** = its weights + trainable values x 4 x (1 gradient + optimizer states) + the
  activations autograd saves over one forward of the task's loss on one batch of the client's
  data (:class:`~fedtune.models.train_memory.ActivationMeter`);
  the activation term is ``a + k x`` those saved bytes, (a, k) fitted per kind from measured runs
  of the recipes (:data:`SUBMODEL_FIT`, ``benchmarks/budgets/fit_capacity.py``, measured as the
  tensor bytes the client's fit allocates, :class:`~fedtune.planning.memory.PeakMeter`): not
  every saved tensor is held at the peak, the backward's transient gradients are not saved (k),
  and some tensors' size does not follow the width (a);
- **seconds** = ``a + b x flop_s`` over the client's speed, where flop_s = 3 x the forward's FLOPs
  (torch's FLOP counter) x the local steps / ``REFERENCE_FLOPS`` (RABO: its T inner steps where y
  is the model, one pass where y is a head fitted on the network's features), (a, b) fitted per
  seconds kind from the CPU seconds measured in the recipes' runs (:data:`SUBMODEL_SECONDS`): a is
  what FLOPs do not count (episodes built, masks chosen, per-step dispatch: at capacity 1/16 it is
  nearly all of a round), b the passes a FLOP count of the training step misses (RABO's and RAFBO's
  hypergradient phase);
- **upload** = the sub-model's values at its mask x the wire bytes per value.

FedMBO (RABO without masks) is priced as RABO at capacity 1 on every client.

FIARSE trains the full-size model with its entries masked (its sub-model is the same count of
values by magnitude), so its memory and seconds are capacity 1's and only its upload shrinks.

RABO's y and x are priced together as the task's model's sub-model (its few-shot head and its
loss parameters are small beside the network); its hypergradient's Hessian-vector products are
not in the prediction, so a run measures the training phase of each client against its budget.
"""

from __future__ import annotations

from fedtune.methods.rabo.masks import SubModel, choose_units, expand, materialize, submodel_of, take
from fedtune.methods.rabo.options import BilevelOptions
from fedtune.methods.rabo.submodel import model_structure
from fedtune.planning.measured import measure_forward
from fedtune.planning.memory import REFERENCE_FLOPS, Prediction
from fedtune.planning.spec import Knob, PlanningContext, PlanSpec
from fedtune.protocol.context import options_as

#: the bilevel methods (T plain inner steps, no optimizer states)
BILEVEL_METHODS = ("rabo", "rafbo", "fedmbo")
#: RABO Sec. V-A's capacities, largest first
CAPACITIES = (1.0, 0.5, 0.25, 0.125, 0.0625)
#: (a bytes, k) of the activation term ``a + k x saved`` per kind, fitted by
#: benchmarks/budgets/fit_capacity.py on the Conv4 recipes (static, fedrolex; rabo), two seeds x five
#: capacities each, against the tensor bytes measured (the same bytes for both seeds): predicted peak
#: within 7.0 % of measured, and FIARSE / RAFBO (checked, not fitted) within 7.0 %; off the fit's
#: Conv4, the tests' tiny few-shot net measures -11 % .. +20 % (static) and +5 % .. +46 % (RABO)
#: (results: benchmarks/results/budgets/capacity-fit.json)
SUBMODEL_FIT: dict[str, tuple[float, float]] = {"single-level": (1727637, 1.055), "bilevel": (1221447, 0.875)}
#: method -> its seconds kind (:data:`SUBMODEL_SECONDS`)
SECONDS_KIND = {"static": "single-level", "fedrolex": "single-level", "fiarse": "single-level"}
SECONDS_KIND |= {"rabo": "implicit", "fedmbo": "implicit", "rafbo": "finite-difference"}
#: (a seconds, b) of ``a + b x flop_s`` per seconds kind, fitted by benchmarks/budgets/fit_capacity.py on
#: the Conv4 recipes' CPU seconds (single-level on Static and FedRolex, FIARSE checked; RABO and RAFBO
#: each on their own runs): see benchmarks/results/budgets/capacity-fit.json
#: (predicted / measured 0.79-1.16 single-level, FIARSE included; 0.88-1.20 RABO; 0.72-1.15 RAFBO; b < 1:
#: this CPU runs the Conv4's FLOPs ~5x faster than REFERENCE_FLOPS, a wall-seconds reference)
SUBMODEL_SECONDS: dict[str, tuple[float, float]] = {"single-level": (0.719, 0.19), "implicit": (0.126, 0.26)}
SUBMODEL_SECONDS |= {"finite-difference": (1.107, 0.69)}


def predict_capacity(context: PlanningContext, capacity: float, fitted: bool = True) -> tuple[Prediction, int]:
    """The predicted cost of one client of ``context``'s run training at ``capacity``, and the
    values it uploads (its sub-model's, at the mask); ``fitted=False``: the activation term is
    the saved bytes themselves and the seconds flop_s (what the fits start from)."""
    from fedtune.models.precision import model_device
    from fedtune.models.tensors import trainable_tensors
    from fedtune.models.train_memory import optimizer_states, weight_bytes

    config, task = context.config, context.task
    structure = model_structure(context)

    def sliced(beta: float) -> SubModel:
        return submodel_of(structure, {g.name: choose_units("static", g, beta, 1, 0) for g in structure.groups})

    sub = sliced(capacity)
    trains = sliced(1.0) if config.method == "fiarse" else sub
    full = {n: t.detach().cpu().numpy() for n, t in trainable_tensors(context.model).items()}
    tensors = expand(take(full, trains), trains, structure.physical, model_device(context.model))
    model = materialize(context.model, tensors)
    saved, forward = measure_forward(context, model)
    bilevel = config.method in BILEVEL_METHODS  # T plain inner steps
    steps = config.train.local_steps
    if bilevel:
        options = options_as(context, BilevelOptions)
        inner = task.bilevel_problem(context, options).inner
        steps = options.inner_steps if set(inner) <= set(full) else 1
    a, k = SUBMODEL_FIT["bilevel" if bilevel else "single-level"] if fitted else (0, 1.0)
    a_s, b_s = SUBMODEL_SECONDS[SECONDS_KIND[config.method]] if fitted else (0.0, 1.0)
    prediction = Prediction(
        weights=weight_bytes(model),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        states=0 if bilevel else optimizer_states(config.train.optimizer, config.train.momentum),
        activations=int(a + k * saved),
        seconds=a_s + b_s * 3 * forward * steps / REFERENCE_FLOPS,
        features=(),
    )
    return prediction, sum(sub.kept(n) for n in full)


def capacity_knob(context: PlanningContext) -> tuple[Knob, str]:
    """The sub-model methods' knob: the capacity on :data:`CAPACITIES`, each priced by
    :func:`predict_capacity` (the planner's ``price``)."""

    def price(v, *_):
        return predict_capacity(context, v)

    return Knob(list(CAPACITIES), lambda p: p.capacity, price, "capacity {:g}".format), ""


def full_model_knob(context: PlanningContext) -> tuple[Knob, str]:
    """FedMBO's: the full model (capacity 1) whatever capacity a profile states (the method ignores
    it; the plan's note names the clients whose capacity is ignored)."""

    def price(v, *_):
        return predict_capacity(context, v)

    ignored = [str(cid) for cid, p in enumerate(context.run.profiles) if p.capacity not in (None, 1.0)]
    method, clients = context.config.method, ", ".join(ignored)
    note = f"{method} trains the full model: the capacities of clients {clients} are ignored" if ignored else ""
    return Knob([1.0], lambda p: None, price, lambda v: "full model"), note


#: the plan of a sub-model method (its knob: ``profile.capacity``): a client builds its sub-model
#: inside its fit, so its measured peak is its fit's growth
CAPACITY_PLAN = PlanSpec("capacity", capacity_knob, peak="growth")
#: RABO's full-model baseline (FedMBO): every client trains the whole model, planned at capacity 1 only
FULL_MODEL_PLAN = PlanSpec(None, full_model_knob, peak="growth")
