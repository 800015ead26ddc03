try:
    from .celery import app as celery_app
except ImportError:  # a node with only the agent installed: no Celery, no Django
    celery_app = None

__all__ = ["celery_app"]
