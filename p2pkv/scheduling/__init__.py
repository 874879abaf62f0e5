"""The scheduler process's half of p2pkv, behind :class:`p2pkv.scheduler.SchedulerSide`.

vLLM runs the connector twice: once in its scheduler (the engine core's
process), once in each worker. What runs in the scheduler lives here, both
roles' halves: a decode leg's load checked, allocated and handed to the
workers (``load_scheduling``, ``load``) with its lease heartbeats
(``heartbeat``); a prefill leg's hold decided and counted against the cap
(``hold_scheduling``, ``hold_ledger``) and a streamed request's chunks per
step (``stream_steps``). What the workers run lives in ``p2pkv/decode/``
(loading KV) and ``p2pkv/prefill/`` (holding and WRITing it).
"""
