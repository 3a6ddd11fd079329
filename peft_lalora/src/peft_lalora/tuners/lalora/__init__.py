"""LA-LoRA as a PEFT tuner: its config, model and registration, and the export to plain LoRA."""
