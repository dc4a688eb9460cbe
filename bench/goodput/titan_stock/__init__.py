"""torchtitan's ``--module bench.goodput.titan_stock``: the demo model with torchtitan's stock
checkpointer (``config_registry.titan_demo_stock``)."""
