"""placeholder"""
def from_gguf(path): raise NotImplementedError
