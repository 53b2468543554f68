"""The graph IR: primitive ops, hash-consed nodes and the lazy Tensor."""
