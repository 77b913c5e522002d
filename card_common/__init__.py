"""Code every service shares.

status    errors <-> gRPC status codes (one table), ``grpc_errors`` decorator, ``error_from_rpc``
tensors   card.v1.Tensor encoding (raw little-endian bytes + dtype + shape)
convert   engine values <-> card.v1 messages (layer, correction, chain, advance, sampling, stats)
serving   server options, health, metrics endpoint, logging, graceful shutdown on SIGTERM/SIGINT
channels  client channels with shared options, ``wait_serving``
cli       CARD_<SERVICE>_<OPTION> variables, logging flags, the one error exit of every command
"""
