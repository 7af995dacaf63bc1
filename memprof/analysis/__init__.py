"""Pure analysis of traces: allocator replay, timeline, peak, sites, categories."""
