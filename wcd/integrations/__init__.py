"""Engine integrations on top of `wcd.client`: thin, engine-specific, never reaching into the server."""
