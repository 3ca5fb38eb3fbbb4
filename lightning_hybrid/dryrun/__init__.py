"""Dry run: play any rank of a large job on one CPU, on torch's fake process group and fake tensors.

``lightning-hybrid dry-run --config RECIPE.yaml`` (:mod:`.cli`) builds each chosen rank with the strategy's own code
(:mod:`.rank`), traces one training step, accounts for its bytes and collectives (:mod:`.accounting`) and holds them
against the planner (:mod:`.compare`); :mod:`.roles` finds the ranks that are identical by construction.
"""
