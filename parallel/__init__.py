"""The main job: a Llama-style decoder trained with FSDP2 × TP/SP or DeepSpeed (see README.md)."""
