"""Compact rollout routing between the inference server and the actors: tensors and bytes in, tensors and bytes out.

No verl import (the agent loop that calls it is :mod:`verl_stable.integration.rollout`). One module per step:

* :mod:`.options`: the ``verl_stable.routing`` options and the manager's dotted path;
* :mod:`.boundary`: one sample's routing validated and compacted at the server boundary, its counters and the
  ``stable/routing/transport/*`` metrics, the fixed SGLang reader;
* :mod:`.fields`: the per-sample fields that carry it (ids, span) and their reading back;
* :mod:`.sharing`: a group's prompt rows stored once (keys, references, the decision and the writer);
* :mod:`.side_rows`: those shared rows read back on the actors and cleared when verl is done with them;
* :mod:`.expansion`: a batch's compact fields back to a :class:`~verl_stable.routing.trace.RoutingTrace` or to
  verl's ``routed_experts``;
* :mod:`.seeding`: each sample's sampling seed from its identity, and the dispatch order;
* :mod:`.packed`: :class:`~verl_stable.transport.packed.PackedRouting`, a batch's routing with prompt rows once per
  group in one buffer (the benchmarks' reference layout).
"""
