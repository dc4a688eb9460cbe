"""Megatron on CPU: shims for megatron-core (``cpu``) and for Megatron-LM's training loop
(``cpu_lm``), applied only without an accelerator. Imports nothing itself."""
