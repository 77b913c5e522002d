"""Prometheus metrics of a draft worker (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

REGISTERED = Gauge("card_draft_registered", "1 while registered with the cache service, else 0")
ACTIVE_SESSIONS = Gauge("card_draft_active_sessions", "Sessions the worker is drafting for")
KV_SLOTS = Gauge("card_draft_kv_slots", "KV cache slots held by all sessions (0 when none is live)")
FORWARDS = Counter("card_draft_forwards", "Draft forwards run (each grows every session that had work)")
BATCH_SESSIONS = Counter("card_draft_batch_sessions",
                         "Sessions served by draft forwards, summed (per forward: over forwards_total)")
PREFIX_QUERIES = Counter("card_draft_prefix_cache_queries",
                         "Committed tokens of new sessions looked up in the draft's prefix cache")
PREFIX_HITS = Counter("card_draft_prefix_cache_hits",
                      "Of them, tokens whose keys and values a slot still held (not prefilled)")
COMMANDS = Counter("card_draft_commands_total", "Commands received from the cache", ["kind"])
LAYERS = Counter("card_draft_layers_published_total", "Layers published to the cache")
LAYERS_DROPPED = Counter("card_draft_layers_dropped_total",
                         "Layers not sent because their session had ended, the cache was away, or "
                         "MAX_QUEUED_LAYERS already waited for the layer stream")
REGISTRATIONS = Counter("card_draft_registrations_total", "Successful registrations with the cache")
DISCONNECTS = Counter("card_draft_disconnects_total", "Times the link to the cache was lost")
LINK_LOST = Counter("card_draft_link_lost_total",
                    "Registrations given up because the link broke, by what broke first "
                    "(commands, layers, heartbeat)", ["cause"])
