"""Features built on the core: graphs, interop and exports, foreign work, traces and the trace page,
Ray, the service, the demo, the chunked pipeline.
"""
