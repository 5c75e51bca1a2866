"""FedAvg-LoRA on MiniLM / SST-2 as a plain Flower App (see ../pyproject.toml)."""
