"""ember replicas on Ray Serve: N engines behind one OpenAI HTTP surface.

The front (the process running ``ember serve --replicas N``) is the ordinary ember
server; only its engine is remote. ``front.ReplicaSet`` takes the place of the
engine thread: it tokenizes locally, computes the request's prefix-cache keys the
way the engines do, and dispatches each request group to a Ray Serve deployment of
:class:`replica.EmberReplica` through a handle whose request router
(:class:`router.PrefixAffinityRouter`) sends it to the replica holding the longest
cached prefix *for that tenant*, unless that replica is overloaded.

Ray is an optional dependency (``pip install 'ember[ray]'``): nothing here is
imported by the single-process server.
"""
