"""`Residency`: every move of chunk groups around compute and the step, as the policy decides.

The placement policy (gemini/policies/) only decides: which tier each kind of chunk starts on, where a group's
optimizer states live, what stays on the device, what to evict and what to prefetch. This class follows the
iteration (which module runs, which backward began, which group got its last gradient) and makes the moves, through
:class:`chunks.Chunk`'s state-checked methods. The hooks and the optimizer call it, never the policy's moves. ZeRO
(``reducer``, ``gatherer``: gemini/parallel/zero.py) and the optimizer states' NVMe tier (``nvme``) are plugged in
from outside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

from chunks import ChunkGroup, ChunkManager, ChunkState, Tier
from gemini.engine.nvme_tier import NvmeTier
from gemini.engine.step_moves import StepMoves
from gemini.parallel.zero import GradReducer, ParamGatherer
from gemini.policies.base import PlacementPolicy
from tracer import Boundary

__all__ = ["Residency"]


class Residency(StepMoves):
    """Where chunk groups are, moved as the iteration goes (around the step: :class:`StepMoves`).

    [Note: parameter chunks around compute]
    Before a module runs (forward, or backward via the pre-backward hook), the param chunks holding its parameters
    get a device copy. A group whose optimizer states live on the host keeps its host copy (``keep_host=True``): the
    device copy is read-only during compute, so dropping it later costs no copy back. ``_compute_refs`` counts modules
    inside their forward that use a chunk (nested modules and tied weights share chunks), so a chunk is never dropped
    under a running module.
    """

    def __init__(self, manager: ChunkManager, policy: PlacementPolicy, *,
                 quiet: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.manager = manager
        self.policy = policy
        # Host-side temporaries made inside it are not device memory (see DeviceMemory.quiet).
        self.quiet = quiet
        self._compute_refs: dict[int, int] = {}
        self._fetched_for_backward: set[int] = set()
        # Modules that use each chunk group in one forward pass, and (inside a root forward) how many of them have
        # yet to run. See [Note: one fetch per pass].
        self._uses_per_forward: dict[int, int] = {}
        self._uses_left: dict[int, int] | None = None
        # Per chunk group: module calls whose backward has begun and not finished in this backward pass (see [Note:
        # a group between its uses in backward]).
        self._backward_uses_open: dict[int, int] = {}
        # Released in backward, dropped when the next module's compute begins without them.
        self._release_pending: set[int] = set()
        self._latest_backward_groups: list[ChunkGroup] = []  # of the call whose backward began last
        self._held: set[int] = set()  # until the step: see [Note: parameters a create_graph pass saved]
        self._pinned: set[int] = set()  # groups kept whole on the device (the policy's choice, applied)
        self.evictions = 0
        # Optimizer states in NVMe files, for groups on the host tier (None: no NVMe tier).
        self.nvme: NvmeTier | None = None
        # ZeRO (None without data parallelism), plugged in by initialize: the gradient reduce-scatter, and with
        # parameter sharding the parameter all-gather.
        self.reducer: GradReducer | None = None
        self.gatherer: ParamGatherer | None = None

    # ----------------------------------------------------------------- the policy's choices
    @property
    def follows_modules(self) -> bool:
        return self.policy.follows_modules

    def setup(self) -> None:
        """After registration: the policy chooses, and its device-resident groups move there."""
        self.policy.setup()
        self.apply_choice()

    def apply_choice(self, *, drop_unkept: bool = False, step_follows: bool = False) -> None:
        """Move groups to match the policy's choice (after ``setup``, a plan adopted or abandoned): whole groups
        pinned on the device, kept parameters fetched (a trainable group's by the step's ``after_commit`` if
        ``step_follows``), groups no longer pinned to the host, and with ``drop_unkept`` the device copies of unkept
        parameters not in use dropped."""
        pinned = self.policy.pinned_groups()
        for i in sorted(self._pinned - pinned):
            for chunk in self.manager.groups[i].chunks:
                if chunk.state is not ChunkState.RELEASED:
                    chunk.move_to(Tier.HOST)
        self._pinned = set(pinned)
        resident = self.policy.resident_params()
        for g in self.manager.groups:
            if g.index in pinned:
                self._pin_on_device(g)
            elif g.index in resident and g.param_shard is None and g.param.state is ChunkState.HOST:
                if not (step_follows and g.trainable):
                    g.param.fetch(keep_host=True)
            elif drop_unkept and self._compute_refs.get(g.index, 0) == 0 and g.index not in self._fetched_for_backward:
                self._maybe_drop_params(g)
        self._grads_on_device_from_now()

    def rebalance_nvme(self) -> None:
        """The device's share of optimizer states changed: the NVMe tier chooses again."""
        if self.nvme is not None:
            self.nvme.rebalance([g for g in self.manager.trainable_groups
                                 if self.policy.optimizer_tier(g) is Tier.HOST])

    def count_uses(self, groups: Iterable[ChunkGroup]) -> None:
        """Record that one module uses ``groups`` in each forward pass."""
        for g in groups:
            self._uses_per_forward[g.index] = self._uses_per_forward.get(g.index, 0) + 1

    # ------------------------------------------------------------------------ forward pass
    # [Note: one fetch per pass]
    # A chunk holds the parameters of several consecutive modules (and a tied weight is used by two). Dropping its
    # device copy after each module would fetch it again for the next one; instead, inside a root forward, a fetched
    # chunk stays until the last module using it has run, so each param chunk crosses to the device once per pass.
    def begin_forward(self) -> None:
        self._uses_left = dict(self._uses_per_forward)
        if self.gatherer is not None:
            self.gatherer.begin_iteration()
        self.policy.begin_forward()

    def end_forward(self) -> None:
        """The root module's forward is over: drop what modules that did not run left behind."""
        self._uses_left = None
        for g in self.manager.groups:
            if self._compute_refs.get(g.index, 0) == 0 and g.index not in self._fetched_for_backward:
                self._maybe_drop_params(g)
        self.policy.end_forward()

    def before_compute(self, groups: list[ChunkGroup]) -> None:
        self.policy.accessed(groups)
        self._drop_released(groups)
        for g in groups:
            self._compute_refs[g.index] = self._compute_refs.get(g.index, 0) + 1
        self._make_resident(groups)

    def after_compute(self, groups: Iterable[ChunkGroup]) -> None:
        for g in groups:
            refs = self._compute_refs[g.index] - 1
            assert refs >= 0, f"chunk group {g.index} released more often than accessed"
            self._compute_refs[g.index] = refs
            if self._uses_left is not None:
                self._uses_left[g.index] = self._uses_left.get(g.index, 0) - 1
                if self._uses_left[g.index] > 0:
                    continue
            if refs == 0 and g.index not in self._fetched_for_backward:
                self._maybe_drop_params(g)

    # ----------------------------------------------------------------------- periods (auto)
    def on_boundary(self, boundary: Boundary) -> None:
        """A period of a planned iteration begins: room for what it needs, then a prefetch of what the next one
        needs, both as the policy decides."""
        wanted = self.policy.on_boundary(boundary)
        if wanted is None:
            return
        self.make_room(0, keep=set(), wanted=wanted)  # see [Note: what a decision keeps] in gemini/policies/auto.py
        for i in self.policy.prefetch():  # see [Note: a prefetch overlaps compute] in chunks/storage.py
            g = self.manager.groups[i]
            if g.param.state is ChunkState.HOST:
                g.param.fetch(keep_host=self._keep_host(g), prefetch=True)

    def mark(self) -> None:
        """A decision point inside a period: a group's first gradient arrives, or a module's backward is done (see
        [Note: segments of a period] in tracer/runtime.py)."""
        self.policy.mark()
        self._room_for_segment()

    def _room_for_segment(self) -> None:  # see [Note: every mark decides] in gemini/policies/auto.py
        if (wanted := self.policy.needed_now()) is not None:
            self.make_room(0, keep=set(), wanted=wanted)

    def make_room(self, nbytes: int, keep: set[int], wanted: set[int] = frozenset()) -> None:
        """Before ``nbytes`` more land on the device: evict what the policy names (``wanted`` last)."""
        if not self.policy.evicts:  # every fetch of every module call passes here
            return
        for i in self.policy.victims(nbytes, keep=keep, in_use=self._in_use, wanted=wanted):
            self._evict(self.manager.groups[i])

    def _in_use(self) -> set[int]:
        """Groups never to evict now: those under a running forward, and those fetched for a backward whose
        gradients are not all in (autograd reads the parameters through saved views)."""
        return self._fetched_for_backward | {i for i, refs in self._compute_refs.items() if refs > 0}

    def _evict(self, g: ChunkGroup) -> None:
        self.evictions += 1
        if g.param.state is ChunkState.HOST_AND_DEVICE:
            g.param.drop_device_copy()
        if g.grad is not None and g.grad.is_on(Tier.DEVICE) and g.grad_shard is None:
            g.grad.move_to(Tier.HOST)

    # ----------------------------------------------------------------------- backward pass
    def before_backward(self, groups: list[ChunkGroup]) -> None:
        """A module call using ``groups`` begins its backward."""
        self.policy.accessed(groups)
        self._drop_released(groups)
        self._latest_backward_groups = groups
        for g in groups:
            self._fetched_for_backward.add(g.index)
            self._backward_uses_open[g.index] = self._backward_uses_open.get(g.index, 0) + 1
        self._make_resident(groups)

    def after_backward(self, group: ChunkGroup) -> None:
        """``group``'s backward is over: every gradient it will get has arrived."""
        self._fetched_for_backward.discard(group.index)
        self._backward_uses_open.pop(group.index, None)
        if self._compute_refs.get(group.index, 0) == 0:
            self._maybe_drop_params(group)
        if group.trainable and self.reducer is not None:
            self.reducer.group_done(group)  # reduce-scattered into its shard (ZeRO)
        elif group.trainable:
            self.grad_done(group)

    def end_backward(self, *, iteration: bool = True) -> None:
        """The backward pass is over (after ``after_backward`` of every group it touched).

        With ``iteration=False``, a graph task that accumulated no parameter gradient (see [Note: a graph task that
        accumulates no parameter gradient] in gemini/engine/backward_hooks.py): its groups are released here, there
        is no gradient to reduce, and the policy's iteration goes on."""
        if not iteration:
            fetched, self._fetched_for_backward = self._fetched_for_backward, set()
            for i in sorted(fetched):
                if self._compute_refs.get(i, 0) == 0:
                    self._maybe_drop_params(self.manager.groups[i])
        self._backward_uses_open.clear()
        self._drop_released([])
        self._latest_backward_groups = []
        if iteration and self.reducer is not None:
            self.reducer.end_backward()
        if self.gatherer is not None:
            busy = {i for i, refs in self._compute_refs.items() if refs > 0} | self._fetched_for_backward
            self.gatherer.release_all(busy)
        if iteration:
            self.policy.end_backward()

    # [Note: parameters a create_graph pass saved]
    # A backward with create_graph=True (an input-gradient penalty) builds a new graph whose nodes save the parameters
    # as views of the param chunks' device copies. That graph runs later, in whichever backward goes through the
    # penalty, and no module hook announces its nodes: dropped meanwhile (storage freed in place, see [Note: device
    # payloads are freed in place] in chunks/storage.py), those parameters would fail there ("setStorage ... out of
    # bounds for storage of size 0"). So every group fetched in such a pass is held as one more compute reference
    # (never dropped or evicted) until the next step: the step changes the saved parameters, after which torch refuses
    # to run that graph anyway. Not until zero_grad: ``loss = ...; opt.zero_grad(); loss.backward()`` is common. A
    # backward that raised ends the iteration too (see [Note: a backward pass that raised] in backward_hooks.py).
    def hold(self, groups: list[ChunkGroup]) -> None:
        """Keep ``groups`` on the device until :meth:`release_held` (see [Note: parameters a create_graph pass
        saved])."""
        for g in groups:
            if g.index not in self._held:
                self._held.add(g.index)
                self._compute_refs[g.index] = self._compute_refs.get(g.index, 0) + 1

    def release_held(self) -> None:
        """The step begins: the groups :meth:`hold` kept go as they would have after their use."""
        held, self._held = self._held, set()
        for i in sorted(held):
            self._compute_refs[i] -= 1
            if self._compute_refs[i] == 0 and i not in self._fetched_for_backward:
                self._maybe_drop_params(self.manager.groups[i])

    # [Note: a group between its uses in backward]
    # Holding a group fetched for backward until all its gradients are in (``after_backward``; autograd reads the
    # parameters through saved views) keeps it on the device through stretches of backward that never read it:
    # gradients arrive once per pass, after every use (two forwards before one backward; a tied embedding read at the
    # start of backward; a group straddling two blocks). So, as in FSDP2, each module call is followed through
    # backward: it *begins* when its outputs' gradients arrive (the pre-backward hook fetches its groups) and is
    # *done* when its inputs' gradients are computed. A group whose begun calls are all done is released (dropped when
    # the next compute begins without it in the warm-up, evictable after it) until a later call's backward fetches it
    # again. A call whose inputs need no gradient (the embedding) is done once every autograd node between its outputs
    # and parameters has run (``hook_nodes_of`` in backward_uses.py); one that cannot report done holds its groups
    # until their gradients are in. Like FSDP2, this assumes backward reads a module's parameters only between its
    # outputs and inputs; a parameter saved off that path (``x + w * w``) read after the release fails loudly (its
    # storage is gone), never with a wrong value.
    def track_backward_uses(self, groups: list[ChunkGroup]) -> bool:
        """Whether releasing ``groups`` between uses in backward can free anything."""
        return self.policy.track_backward_uses(groups)

    def backward_use_done(self, groups: list[ChunkGroup]) -> None:
        """A module call using ``groups`` whose backward began has finished it."""
        self.policy.mark()  # its decision comes below, once the released groups may go
        released = False
        for g in groups:
            left = self._backward_uses_open.get(g.index, 0) - 1
            if left < 0:
                continue  # released already: every gradient of the group is in
            self._backward_uses_open[g.index] = left
            if left == 0 and g.index in self._fetched_for_backward:
                self._fetched_for_backward.discard(g.index)
                self._release_pending.add(g.index)
                released = True
        if released:
            # Normally the call that began last is this one, which keeps what it released for the next call; but
            # when the next call began first (hooks on one tensor: the head's inputs are the final norm's outputs),
            # what it does not use is dropped now.
            self._drop_released(self._latest_backward_groups)
        self._room_for_segment()  # released or not: the new segment's peak may be larger

    def _drop_released(self, needed: list[ChunkGroup]) -> None:
        """Drop the groups released in backward that the compute beginning now does not use.

        A released group is not dropped at once: a group straddling two modules is often released by one and used by
        the very next (block i+1's first module, then block i's last), and dropping it in between would only fetch it
        again."""
        if not self._release_pending:
            return
        keep = {g.index for g in needed}
        for i in self._release_pending - keep:
            if self._compute_refs.get(i, 0) == 0 and i not in self._fetched_for_backward:
                self._maybe_drop_params(self.manager.groups[i])
        self._release_pending &= keep

    def groups_fetched_for_backward(self) -> list[ChunkGroup]:
        return [self.manager.groups[i] for i in sorted(self._fetched_for_backward)]

    # ---------------------------------------------------------------------------- helpers
    def _keep_host(self, g: ChunkGroup) -> bool:
        return self.policy.optimizer_tier(g) is Tier.HOST if g.trainable else True

    def _make_resident(self, groups: list[ChunkGroup]) -> None:
        for g in groups:  # prefetched: compute waits for the copy now ([Note: a prefetch overlaps compute])
            g.param.ready_on_device()
        if self.gatherer is not None:  # ZeRO-3: gathered from the ranks' shards
            missing = [g for g in groups if not self.gatherer.gathered(g)]
            if missing:
                self.make_room(sum(g.param.nbytes for g in missing), keep={g.index for g in groups})
            self.gatherer.gather(groups)
            return
        missing = [g for g in groups if g.param.state is ChunkState.HOST]
        if not missing:
            return
        self.make_room(sum(g.param.nbytes for g in missing), keep={g.index for g in groups})
        for g in missing:
            g.param.fetch(keep_host=self._keep_host(g))

    def _maybe_drop_params(self, g: ChunkGroup) -> None:
        if self.gatherer is not None:
            # ZeRO-3: released after use whatever the policy (prefetched ones wait for their use).
            if g.index not in self.gatherer.prefetched:
                self.gatherer.release(g)
            return
        if g.param.state is ChunkState.HOST_AND_DEVICE and not self.policy.keep_params_on_device(g):
            g.param.drop_device_copy()

    # [Note: what every step keeps is there from the first]
    # A group whose optimizer states update on the device keeps its gradient chunk there after the step (zero_grad
    # forgets gradients, not storage), so from the second iteration on it is on the device through the forward. Were
    # it allocated by the first backward, the first forward's peak would be lower than later ones, and a budget could
    # pass the first step (whose check is the promise) and fail the second. So applying the policy's choice allocates
    # the kept gradient chunks (the step's: the shard under ZeRO) at once, and a pinned group's Adam step counts move
    # there too. ``initialize``'s check counts these bytes already (``footprint.chunk_bytes``); no per-step cost.
    def _grads_on_device_from_now(self) -> None:
        """The gradient chunks the step leaves on the device are there from now on (see [Note: what every step
        keeps is there from the first])."""
        for g in self.manager.trainable_groups:
            if g.step_grad.state is ChunkState.RELEASED and self.policy.keep_grads_on_device(g):
                g.step_grad.allocate(Tier.DEVICE)

    def _pin_on_device(self, g: ChunkGroup) -> None:
        """Keep every flavour of ``g`` on the device only (its optimizer states update there)."""
        if self.nvme is not None:
            self.nvme.bring_back(g)
        for chunk in g.chunks:
            if chunk.state is not ChunkState.RELEASED:
                chunk.move_to(Tier.DEVICE)
        if g.trainable:  # Adam's step counts go with the states (the step would move them)
            g.steps = g.steps.to(self.manager.storage.tier_device(Tier.DEVICE))
