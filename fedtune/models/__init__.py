"""Networks and model plumbing that several methods and tasks share: loading by name or path,
the PEFT LoRA workspace, the local training loop, the vision, audio, few-shot and prefix-LM
networks, and training-memory accounting. A method's own maths lives with the method
(``fedtune.methods.<family>``)."""
