"""torch.library custom ops `tk::*`, one module per family, each with its plain PyTorch reference."""
