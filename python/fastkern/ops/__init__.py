"""One module per op: torch.library definitions, fake implementations and autograd."""
