"""Engine replicas on Ray Serve, with prefix-cache-affinity routing (``pagedserve serve --num-replicas N``).

``settings`` (the ``--num-replicas`` flags) and ``prefix_tree`` import no ray; ``forwarding``, the
request and response carried between the ingress and a replica, neither. ``router``, ``ingress``,
``deployment`` and ``launch`` need the ``ray`` extra. docs/replicas.md describes how it works.
"""
