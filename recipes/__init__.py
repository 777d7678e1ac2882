"""The recipe script, recipes/flux_grpo.py, as a package so that an install carries it (``flux-grpo train`` runs it).

It is still run as a script (``python recipes/flux_grpo.py --config ...``, launch/run.sh, torchrun) and loaded by path
(tools/_recipe.py ``load_recipe``: a copied and edited recipe loads the same way); nothing imports it by name.
"""
