def supported(dtype):
    return False
