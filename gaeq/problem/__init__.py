"""WHAT is trained: data, model, loss and optimisation — identical for every trainer and split."""
