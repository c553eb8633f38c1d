"""Engine integrations: `hf` (Hugging Face transformers); each needs its own extra."""
