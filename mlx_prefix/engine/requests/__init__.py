"""A request's life around the model, engine thread and callers alike: the Job every
stage shares (jobs.py: the engine's floor, importing no stage), the handle its caller
reads events from (handle.py), the checks before it is queued (admission.py), the inbox
and its one final event (lifecycle.py), the waiting list and who starts next
(scheduler.py), how much prefill shares a step with decode (pace.py), and the next-turn
prefetch that follows a chat's reply (prefetch.py, chat_traffic.py). Import each name
from its module.
"""
