"""The fleet (DESIGN §12): fill an entry from a peer daemon over NIXL before reading the disk.

Imported only when the config has `[fleet]`: `channel` (the authenticated control channel),
`helpers` and `agent` (the processes that hold NIXL, never the daemon), `service` (serving peers,
filling from them).
"""
