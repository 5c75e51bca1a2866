"""The sections of what a run learns and how each client trains: ``[task]``, ``[data]``, ``[model]``, ``[train]``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from fedtune.config.base import Section


class TaskConfig(Section):
    """What a run learns (``fedtune tasks``): ``kind`` plus the task's own options, checked by the
    task (``task = "image-classification"`` is ``[task] kind = "image-classification"``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # every number finite
    kind: str = Field("text-classification", description="task kind (fedtune tasks)")

    @model_validator(mode="before")
    @classmethod
    def _string_is_name(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    @property
    def options(self) -> dict[str, Any]:
        """The task's own options (every key but ``kind``)."""
        return dict(self.model_extra or {})


class DataConfig(Section):
    """``[data]``: the data set, where it lives, the test subsample and tokens per example."""

    name: str | None = Field(
        None, description="data set (default: the task's; text: tweets, sst2, agnews, a local file, or hub:<dataset>)"
    )
    data_dir: str | None = Field(None, description="folder of named sets (default: $FEDTUNE_DATA_DIR)")
    test_path: str | None = Field(None, description="evaluation file when name is a local file")
    text_column: str | None = Field(None, description="text column (local files and hub sets)")
    label_column: str | None = Field(None, description="label column (local files and hub sets)")
    hub_config: str | None = Field(None, description="hub dataset configuration name")
    train_split: str = Field("train", description="hub sets: the split clients train on")
    test_split: str = Field("test", description="hub sets: the split the server evaluates on")
    partition: Literal["iid", "dirichlet", "dirichlet-client", "shards", "column"] = Field(
        "dirichlet",
        description="iid; Dirichlet label skew per class or per client (Hsu et al. 2019); label shards; "
        "the data's own client column (client_column)",
    )
    client_column: str | None = Field(
        None, description="partition 'column': the column naming each example's client (dolly: fedit_client)"
    )
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (smaller = more label skew)")
    shards_per_client: int = Field(2, gt=0, description="shards partition: label-sorted shards per client")
    max_train_samples: int | None = Field(None, gt=0, description="subsample the training pool")
    max_test_samples: int | None = Field(None, gt=0, description="subsample the test set")
    max_length: int = Field(64, gt=1, le=4096, description="tokens per example")


class ModelConfig(Section):
    """``[model]``: the model, its LoRA adapters, what full fine-tuning trains, base dtype and quantization."""

    name: str | None = Field(None, description="model (default: the task's; text: minilm), a hub name, or a local path")
    lora_rank: int = Field(8, gt=0, description="r: the LoRA rank (the largest, where clients' ranks differ)")
    lora_alpha: float = Field(16.0, gt=0, description="alpha: LoRA's scale is alpha / r")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on LoRA's input")
    target_modules: list[str] | None = Field(
        None, description="LoRA target modules (default: the task's for its model)"
    )
    finetune: Literal["full", "head"] = Field(
        "full", description="what methods without LoRA (fedavg) train: every parameter, or the head only"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the frozen base weights (adapters, heads and optimizer state: float32)"
    )
    quantization: Literal["none", "8bit", "4bit"] = Field(
        "none", description="quantize the frozen base's linear layers with bitsandbytes (4bit: NF4 + double quant)"
    )


class TrainConfig(Section):
    """``[train]``: each client's local training per round (steps, batches, optimizer) and evaluation batches."""

    local_steps: int = Field(10, gt=0, description="optimizer steps per client per round (H)")
    batch_size: int = Field(16, gt=0, description="examples per local step")
    lr: float = Field(5e-4, gt=0, description="local learning rate")
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="local optimizer; FSLoRA's Algorithm 1 takes plain SGD steps (eq. (4))"
    )
    momentum: float = Field(
        0.0, ge=0, lt=1, description="heavy-ball momentum of optimizer='sgd' (the published FSLoRA GLUE clients: 0.9)"
    )
    weight_decay: float = Field(0.0, ge=0, description="the local optimizer's weight decay")
    eval_batch_size: int = Field(128, gt=0, description="examples per evaluation batch")
    group_by_length: bool = Field(True, description="batch examples of similar length (less padding)")
    threads: int | None = Field(None, gt=0, description="torch threads (default: torch's choice)")
    gradient_checkpointing: bool = Field(
        False, description="recompute the base's activations in the backward pass (less memory, more compute)"
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.momentum and self.optimizer != "sgd":
            raise ValueError(f"train.momentum: applies to train.optimizer='sgd' (got optimizer={self.optimizer!r})")
        return self
