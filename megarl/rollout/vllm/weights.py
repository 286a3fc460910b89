"""Writing new weights straight into a live vLLM model's own parameters, module by module.

vLLM keeps some parameters in a processed form (on CPU, linear weights are repacked for oneDNN
and MoE experts prepacked and padded), so a parameter cannot simply be overwritten. vLLM's
layerwise reload (vllm.model_executor.model_loader.reload) solves this for its own loaders: every
module goes back to its load-time shapes on the meta device, and once a module is complete it is
materialized, processed and copied into the tensors kernels hold. megarl uses that machinery but
not the loaders: `open` materializes a module's load-time tensors for the sync to write into,
`close` processes them and copies them into the live ones, so one module at a time is resident
and no HF tensor passes through Python. Works the same on GPU (processing there is a no-op or a
shuffle for unquantized weights; the copy back keeps CUDA-graph addresses).
"""

from typing import Dict, Sequence, Set, Tuple

import torch

from megarl.platform import device_choice
from megarl.rollout.engine import WeightUpdateReport
from megarl.rollout.vllm import cpu_fixes as vllm_cpu_fixes
from megarl.rollout.vllm.fp8_engine import QuantizedWrites


class InPlaceWriter:
    def __init__(self, model: torch.nn.Module, model_config):
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.model, self.model_config = model, model_config
        self._info = get_layerwise_info
        # Names as vLLM reports them (tied weights once), shapes as its loaders see them; with LoRA
        # on, vLLM wraps each adapted layer and its weights are the wrapper's base_layer's: known
        # here by the plain names the sync plans.
        self._real = {name.replace(".base_layer.", "."): name for name, _ in model.named_parameters()}
        self.names = list(self._real)
        self.written: Set[str] = set()
        # FP8 engines (rollout/vllm/fp8_engine.py): the sync writes the senders' codes and scales,
        # or bf16 into staging tensors quantized into codes and scales as each module closes (their
        # scales are then not planned).
        self.fp8 = QuantizedWrites({name: self._load_dtype(name) for name in self.names}, model_config.dtype)

    def begin(self, expected: Dict[str, Tuple[int, ...]]) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        # Tensors vLLM derives while processing (MLA's W_UK_T and W_UV, from kv_b_proj) are gone
        # during a reload and made again when it finishes: nothing loads them.
        self.names = [name for name in self.names if self._loaded_at_load_time(name)]
        shapes = {name: tuple(self._load_shape(name)) for name in self.names
                  if name not in self.fp8.derived or name in expected}
        missing = sorted(set(shapes) - set(expected))
        unexpected = sorted(set(expected) - set(shapes))
        wrong = sorted(f"{n}: engine {shapes[n]}, plan {tuple(expected[n])}"
                       for n in set(shapes) & set(expected) if shapes[n] != tuple(expected[n]))
        if missing or unexpected or wrong:
            self.finish()  # put the model back as it was before refusing
            raise ValueError(f"the sync plan does not match this vLLM model: {len(missing)} engine "
                             f"parameters unplanned (e.g. {missing[:3]}), {len(unexpected)} planned "
                             f"ones it lacks (e.g. {unexpected[:3]}), shapes differ: {wrong[:3]}. "
                             "megarl.models.weights.destination encodes vLLM's layouts: update it for "
                             "this vLLM version or model family")
        self.fp8.expect(expected)
        self.written = set()

    def _loaded_at_load_time(self, name: str) -> bool:
        module, _, param = self._real[name].rpartition(".")
        layer = self.model.get_submodule(module)
        return param in self._info(layer).restore_metadata[0] or hasattr(layer, param)

    def _load_time(self, name: str) -> torch.Tensor:
        """The parameter as vLLM's loaders see it (a meta tensor of its load-time shape and dtype)."""
        module, _, param = self._real[name].rpartition(".")
        layer = self.model.get_submodule(module)
        meta = self._info(layer).restore_metadata[0]
        # vLLM keeps a few tensors live through a reload (SKIP_TENSORS: biases, routing bias).
        return meta[param] if param in meta else getattr(layer, param)

    def _load_shape(self, name: str) -> torch.Size:
        return self._load_time(name).shape

    def _load_dtype(self, name: str) -> torch.dtype:
        return self._load_time(name).dtype

    def open(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        for module in dict.fromkeys(self._real[name].rpartition(".")[0] for name in names):
            layer = self.model.get_submodule(module)
            materialize_layer(layer, self._info(layer))
        opened = {name: self.model.get_parameter(self._real[name]).data for name in names}
        return {name: self.fp8.target(name, t) for name, t in opened.items()}

    def loaded(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        """The open load-time tensors, as written so far (before close processes them)."""
        return {name: self.model.get_parameter(self._real[name]).data for name in names}

    def close(self, names: Sequence[str]) -> None:
        self.written.update(self.fp8.quantize(self.model, self._real, names))
        for module in dict.fromkeys(self._real[name].rpartition(".")[0] for name in names):
            self._process(self.model.get_submodule(module))
        self.written.update(names)

    def _process(self, layer: torch.nn.Module) -> None:
        """vLLM's _layerwise_process after its loaders would have run: process the written
        load-time tensors, copy them into the live ones, put those back on the module."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        info = self._info(layer)
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        for tensor in get_layer_tensors(layer).values():
            tensor.weight_loader = layerwise._get_original_loader(tensor)
        quant_method = getattr(layer, "quant_method", None)
        if isinstance(quant_method, QuantizeMethodBase):
            quant_method.process_weights_after_loading(layer)
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
        if not device_choice.on_gpu():
            vllm_cpu_fixes.prepack_reloaded_moe(layer, info.kernel_tensors[0])
        layerwise._copy_and_restore_kernel_tensors(layer, info)
        info.reset()

    def finish(self, only: Sequence[str] = ()) -> WeightUpdateReport:
        """`only`: the update rewrote these tensors alone (every other module keeps its live
        tensors, put back here quietly: vLLM's finalize warns of each as a failed load)."""
        from vllm.model_executor.model_loader.reload import layerwise

        if only:
            for layer in self.model.modules():
                info = self._info(layer)
                if info.can_load() and info.kernel_tensors is not None and \
                        not layerwise.is_deferred_attention_layer(layer):
                    layerwise._place_kernel_tensors(layer, info)
                    info.reset()
        layerwise.finalize_layerwise_reload(self.model, self.model_config)
        if not device_choice.on_gpu():
            vllm_cpu_fixes.refresh_tied_lm_head(self.model)
        expected = set(only or self.names)
        return WeightUpdateReport(params_expected=len(expected),
                                  params_loaded=len(self.written & expected),
                                  missing=sorted(expected - self.written),
                                  unexpected=sorted(self.written - expected))
