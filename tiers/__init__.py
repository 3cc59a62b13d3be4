"""Storage tiers (host shared memory, SSD, GPU, remote) and the codecs blocks are stored with."""
