"""MegaFBD: forward/backward decoupling with virtual ranks and a bit-vector coordinator."""
