"""Periodic loops of the registry, merged into Celery beat by config/celery.py."""

BEAT_SCHEDULE = {
    # A failed canary gate takes effect within one tick: seconds, not minutes.
    "registry-rollout-tick": {
        "task": "registry.rollout_tick",
        "schedule": 2.0,
        "options": {"expires": 2.0},
    },
    "registry-publish-visibility": {"task": "registry.publish_visibility", "schedule": 60.0},
}
