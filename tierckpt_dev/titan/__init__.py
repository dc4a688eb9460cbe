"""torchtitan on CPU: patches (``cpu``), demo corpus and tokenizer (``assets``) and the demo's
config function for ``--module tierckpt_dev.titan --config titan_demo`` (``config_registry``).
Imports nothing itself."""
