"""The policy of which kernel runs: one interface and one registry per role -- attention/ (MLA), experts/ (the
routed experts), linear (dense GEMMs), all_to_all (expert-parallel dispatch / combine)."""
