"""InfiniGen's fetch as a mechanism apart from its selection: the entries a speculation picked, gathered from the
host tier into one reused staging buffer and copied to the device. On CUDA the buffer is pinned and the copy runs on
a side stream that records an event; the layer that reads the entries waits on that event, and the next gather
waits for the last copy out of the buffer before overwriting it. On a CPU the staging buffer itself is read.

The policy that mixes it in holds `spec`, `ledger`, `device`, `host_k` and `host_v` ([sparse layer, row, KV head,
token, dim]), and calls `_reset_fetch` when it starts and finishes."""

from __future__ import annotations

import torch


class StagedFetch:
    def _reset_fetch(self, cuda: bool = False) -> None:
        """No staging buffer yet and no copy in flight; on CUDA, a side stream for the copies."""
        self.stream = torch.cuda.Stream() if cuda else None
        self.staging = None  # [2 (keys, values), elements]: what the last fetch gathered (_gather)
        self.copied = None  # the event the side stream records after its last copy out of the staging buffer

    def _gather(self, i: int, rows: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries idx [B, Hkv, W] of sparse layer i's rows, keys and values [B, Hkv, W, D], gathered into the
        staging buffer: pinned where a side stream copies from it (an advanced index would make a new pageable
        tensor, whose copy CUDA stages through a pinned one of its own, blocking the host)."""
        b, h, w = idx.shape
        d = self.spec.head_dim
        n = b * h * w
        if self.copied is not None:
            self.copied.synchronize()  # the last copy out of the buffer has landed before it is overwritten
        if self.staging is None or self.staging.shape[1] < n * d:
            # grown to twice the need: the fetch grows with the rows, and pinning memory is slow
            size = 2 * n * d if self.staging is not None else n * d
            held = self.staging.nbytes if self.staging is not None else 0
            self.staging = torch.empty((2, size), dtype=self.spec.dtype, pin_memory=self.stream is not None)
            self.ledger.add("host", "overhead", self.staging.nbytes - held, where="infinigen staging buffer")
        # one flat index per (row, head, pick) into the layer's [rows x Hkv x tokens, D] entries
        cap = self.host_k.shape[3]
        flat = ((rows[:, None, None] * h + torch.arange(h)[None, :, None]) * cap + idx).reshape(-1)
        out = []
        for tier, buffer in zip((self.host_k, self.host_v), self.staging):
            entries = tier[i].view(-1, d)
            out.append(torch.index_select(entries, 0, flat, out=buffer[:n * d].view(n, d)).view(b, h, w, d))
        return out[0], out[1]

    def _copy(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered entries on the device: on CUDA copied on the side stream, its event recorded for the layer
        that reads them (_attend_fetched); on a CPU the staging buffer itself, read before the next gather."""
        if self.stream is None:
            return k.to(self.device), v.to(self.device)
        with torch.cuda.stream(self.stream):
            k_dev, v_dev = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
            self.copied = self.stream.record_event()
        compute = torch.cuda.current_stream()
        for t in (k_dev, v_dev):  # made on the side stream, read and freed on the compute stream
            t.record_stream(compute)
        return k_dev, v_dev

    def _wait_for_copy(self) -> None:
        if self.stream is not None:  # the device waits for the copy, the host goes on
            torch.cuda.current_stream().wait_event(self.copied)
