"""The file format, pure data and no I/O: the torch zip layout, object -> save plan, and the unpickler of loads."""
