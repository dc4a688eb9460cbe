"""cluster: topology (nodes, ranks, groups, cliques), collectives, accelerator detection."""
