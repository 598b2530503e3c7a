"""The frontend: calls from any number of threads (or coroutines) over one process group.

* `receiver` -- `Dispatcher`, one per group: the receiver thread (the only reader of the results
  socket: routes each message to its call by the call id it names, and watches the children) and
  the registry of running calls.
* `ledger` -- the credits the calls share (in-flight slots, text held for re-sending, requests per
  render worker and per engine core for least-loaded dispatch), settled in one place.
* `call` -- `Call`, one per embed/encode/... call: draws its input in blocks, sends them, handles
  failures and lost workers, ends (its lifecycle is in that module's docstring).
* `reorder` -- a call's ring of slots: answers stored by index as they come, handed back in order.

Locks: the dispatcher's `lock` guards the registry, the ledger's its counts (never both at once);
the group's `send_lock` guards its sockets. A call that ends early takes no lock (the garbage
collector may end it in any thread): it queues itself and the receiver thread settles it.
"""

from pooling_pipeline.frontend.call import Call, new_call_prefix
from pooling_pipeline.frontend.receiver import Dispatcher

__all__ = ["Call", "Dispatcher", "new_call_prefix"]
