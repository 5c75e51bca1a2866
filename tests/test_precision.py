"""Mixed precision of a frozen base (fedtune.models.precision): under ``model.dtype = bfloat16``
the matrix layers are bfloat16 and every norm (LayerNorm in BERT, RMSNorm in Llama) stays float32,
whether the CPU computes in bfloat16 (cast) or not (stored in it, computed in float32)."""

from __future__ import annotations

import pytest
import torch

from fedtune.config import load_config
from fedtune.models import precision
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.causal_lm import CausalLM
from tests.conftest import TINY

MODELS = {"tiny-bert": TINY, "tiny-llama": ["task.kind=causal-lm", *CausalLM.test_overrides]}


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("model", list(MODELS))
def test_a_bfloat16_base_keeps_every_norm_in_float32_and_casts_the_matrix_layers(model, native, monkeypatch):
    monkeypatch.setattr(precision, "computes_natively", lambda device, dtype: native)
    config = load_config(None, [*MODELS[model], "model.dtype=bfloat16", "device=cpu"])
    base = precision.prepare_base(RunContext(resolve_run(config)).task.build_model(0), config)
    norms = [(n, m) for n, m in base.named_modules() if "Norm" in type(m).__name__]
    assert {type(m).__name__ for _, m in norms} >= ({"LayerNorm"} if model == "tiny-bert" else {"LlamaRMSNorm"})
    for name, module in norms:
        assert all(p.dtype == torch.float32 for p in module.parameters(recurse=False)), name
    matrices = [m for m in base.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    assert matrices and all(m.weight.dtype == torch.bfloat16 for m in matrices)
