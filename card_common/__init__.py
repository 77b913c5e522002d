"""Code every service shares.

status    errors <-> gRPC status codes (one table), ``grpc_errors`` decorator, ``error_from_rpc``
tensors   card.v1.Tensor encoding (raw little-endian bytes + dtype + shape)
convert   engine values <-> card.v1 messages (layer, correction, chain, advance, sampling, stats)
serving   gRPC servers and their options, health, metrics endpoint, logging, graceful shutdown
gate      every call of a gRPC server: its budget, its message's deadline, refusals before reading
health    grpc.health.v1's one owner of statuses, and health ports on asyncio (no caller holds one)
metrics_port  the Prometheus port, bounded (connections, timeouts)
auth      bearer tokens and roles (CACHE_ROLES, TARGET_ROLES), TokenAuth
channels  client channels with shared options, ``wait_serving``
cli       CARD_<SERVICE>_<OPTION> variables, logging flags, the one error exit of every command
"""
