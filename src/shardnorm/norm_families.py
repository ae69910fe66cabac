"""The table `convert` reads: which norm classes shardnorm knows, and the math each one does.

Each family names the forward its classes compute (checked class by class against the installed
transformers by tests/test_hf_models.py): adding a class means checking its forward against a family's;
a new kind of math is a new `NormFamily`. Where each family rounds to the input dtype: docs/convert.md.
Class lists: generated from transformers 5.23 by grouping every norm class by its forward's source.
"""

from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch


@dataclass(frozen=True)
class NormFamily:
    """How one kind of norm computes y from x, in the terms shardnorm's modules take.

    rms: no mean subtracted (RMSNorm); else LayerNorm.
    zero_centered_gamma: the scale is (1 + weight) with the stored weight unchanged (Gemma).
    bias: the module has a `bias` Parameter added after the scale (LayerNorm only).
    eps_attr: the attribute holding eps ("variance_epsilon", "eps", "epsilon").
    scale_in: "float32" (scale, then cast to the input dtype) or "input" (cast, then scale, rounding twice
        in bf16/fp16); shardnorm always scales in fp32, so it only records how far the original differs.
    half_weight_output: y takes the weight's dtype where that is fp16 or bf16 and x's is another (T5's casts x to
        such a weight's dtype before the scale): the layers after it run in the weight's dtype while x may come in
        fp32 (transformers keeps T5's `wo` in fp32 under fp16, `_keep_in_fp32_modules`).
    """

    name: str
    rms: bool
    eps_attr: str
    zero_centered_gamma: bool = False
    bias: bool = False
    scale_in: str = "float32"
    half_weight_output: bool = False


LLAMA = NormFamily("llama", rms=True, eps_attr="variance_epsilon", scale_in="input")
LLAMA4 = NormFamily("llama4", rms=True, eps_attr="eps", scale_in="input")
FLOAT32_SCALE = NormFamily("olmo2", rms=True, eps_attr="variance_epsilon")
FLOAT32_SCALE_EPS = NormFamily("moshi", rms=True, eps_attr="eps")
GEMMA = NormFamily("gemma", rms=True, eps_attr="eps", zero_centered_gamma=True)
GEMMA3N = NormFamily("gemma3n", rms=True, eps_attr="eps")  # `with_scale=True` only: else no weight
T5 = NormFamily("t5", rms=True, eps_attr="variance_epsilon", scale_in="input", half_weight_output=True)
COHERE = NormFamily("cohere", rms=False, eps_attr="variance_epsilon")  # LayerNorm without bias
DEBERTA = NormFamily("deberta", rms=False, eps_attr="variance_epsilon", bias=True, scale_in="input")
TORCH_LAYER_NORM = NormFamily("torch.nn.LayerNorm", rms=False, eps_attr="eps", bias=True)
TORCH_RMS_NORM = NormFamily("torch.nn.RMSNorm", rms=True, eps_attr="eps")

# class name -> family. Matched by name (a model's own copy of, say, LlamaRMSNorm counts as one) after the
# structural check in `mismatch`, which every listed class passes.
_CLASSES = {
    LLAMA: (
        "AXK1RMSNorm", "AXK2RMSNorm", "Aimv2RMSNorm", "ApertusRMSNorm", "ArceeRMSNorm", "AriaTextRMSNorm",
        "BailingHybridRMSNorm", "BambaRMSNorm", "BitNetRMSNorm", "BltRMSNorm", "ChameleonRMSNorm", "ClvpRMSNorm",
        "Cohere2MoeRMSNorm", "Cosmos3EdgeTextRMSNorm", "CsmRMSNorm", "CwmRMSNorm", "DeepseekOcr2TextRMSNorm",
        "DeepseekOcr2VisionRMSNorm", "DeepseekV2RMSNorm", "DeepseekV32RMSNorm", "DeepseekV3RMSNorm", "Deimv2RMSNorm",
        "DiaRMSNorm", "DiffLlamaRMSNorm", "DogeRMSNorm", "Dots1RMSNorm", "Dots3NoteRMSNorm", "Emu3RMSNorm",
        "Ernie4_5RMSNorm", "Ernie4_5_MoeRMSNorm", "Ernie4_5_VLMoeRMSNorm", "EuroBertRMSNorm", "EvollaRMSNorm",
        "Exaone4RMSNorm", "Exaone4_5_RMSNorm", "ExaoneMoeRMSNorm", "FalconH1RMSNorm", "FalconMambaRMSNorm",
        "Glm4MoeLiteRMSNorm", "Glm4MoeRMSNorm", "Glm4RMSNorm", "Glm4vMoeRMSNorm", "Glm4vMoeTextRMSNorm",
        "Glm4vRMSNorm", "Glm5NextRMSNorm", "Glm5NextTextRMSNorm", "GlmImageRMSNorm", "GlmMoeDsaRMSNorm",
        "GlmOcrRMSNorm", "GlmRMSNorm", "Granite4VisionTextRMSNorm", "GraniteDoclingTextRMSNorm",
        "GraniteMoeHybridRMSNorm", "GraniteMoeRMSNorm", "GraniteMoeSWARMSNorm", "GraniteMoeSharedRMSNorm",
        "GraniteRMSNorm", "GraniteSWARMSNorm", "HYV3RMSNorm", "HYV4RMSNorm", "HiggsAudioV2RMSNorm",
        "HunYuanDenseV1RMSNorm", "HunYuanMoEV1RMSNorm", "HunYuanVLRMSNorm", "HyperCLOVAXRMSNorm", "Idefics2RMSNorm",
        "Idefics3RMSNorm", "InklingRMSNorm", "InternVLVisionRMSNorm", "JambaRMSNorm", "JetMoeRMSNorm",
        "KimiLinearRMSNorm", "Kolibri1RMSNorm", "LagunaRMSNorm", "Lfm2MoeRMSNorm", "Lfm2RMSNorm", "Lfm3RMSNorm",
        "Lfm3VlVisionRMSNorm", "LightOnOcrRMSNorm", "LlamaRMSNorm", "LongcatFlashRMSNorm", "Mamba2RMSNorm",
        "MambaRMSNorm", "MellumRMSNorm", "MiMoV2FlashRMSNorm", "MiniCPM3RMSNorm", "MiniMaxM2RMSNorm", "MiniMaxRMSNorm",
        "Ministral3RMSNorm", "MinistralRMSNorm", "Mistral3RMSNorm", "Mistral4RMSNorm", "MistralLarge4RMSNorm",
        "MistralRMSNorm", "MixtralRMSNorm", "MllamaTextRMSNorm", "Molmo2RMSNorm", "MuseGlimmerAssistantRMSNorm",
        "NeuCodecRMSNorm", "OlmoeRMSNorm", "Ovis2RMSNorm", "PaddleOCRRMSNorm", "PeAudioEncoderRMSNorm",
        "PeAudioVideoEncoderRMSNorm", "PeVideoEncoderRMSNorm", "Phi3RMSNorm", "Phi4MultimodalRMSNorm",
        "PixtralRMSNorm", "QianfanOCRVisionRMSNorm", "Qwen2MoeRMSNorm", "Qwen2RMSNorm", "Qwen2VLRMSNorm",
        "Qwen2_5OmniRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3MoeRMSNorm", "Qwen3OmniMoeCode2WavRMSNorm",
        "Qwen3OmniMoeRMSNorm", "Qwen3OmniMoeTextRMSNorm", "Qwen3OmniMoeThinkerTextRMSNorm", "Qwen3RMSNorm",
        "Qwen3VLMoeTextRMSNorm", "Qwen3VLTextRMSNorm", "Sapiens2RMSNorm", "SeedOssRMSNorm", "SmolLM3RMSNorm",
        "SolarOpenRMSNorm", "TimesFm2_5RMSNorm", "TimesFmRMSNorm", "UltraVBertRMSNorm", "UltrabertRMSNorm",
        "UnlimitedOcrTextRMSNorm", "VibeVoiceAcousticTokenizerRMSNorm", "VibeVoiceAsrRMSNorm", "VibeVoiceRMSNorm",
        "VoxtralRealtimeRMSNorm", "Xcodec2RMSNorm", "YoutuRMSNorm", "Zamba2RMSNorm", "ZambaRMSNorm", "ZayaRMSNorm",
    ),
    LLAMA4: ("Llama4TextRMSNorm",),
    FLOAT32_SCALE: (
        "AfmoeRMSNorm", "BeamRMSNorm", "FlexOlmoRMSNorm", "FlintRMSNorm", "GptOssRMSNorm", "HeliumRMSNorm",
        "Inkling2RMSNorm", "NemotronHRMSNorm", "NemotronH_Omni_RMSNorm", "Olmo2RMSNorm", "Olmo3RMSNorm",
        "OlmoHybridRMSNorm", "OpenAIPrivacyFilterRMSNorm",
    ),
    FLOAT32_SCALE_EPS: ("KyutaiSpeechToTextRMSNorm", "MoshiRMSNorm"),
    GEMMA: (
        "Gemma2RMSNorm", "Gemma3RMSNorm", "GemmaRMSNorm", "MiniMaxM3VLRMSNorm", "MuseGlimmerTextCenteredRMSNorm",
        "Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3_5RMSNorm", "RecurrentGemmaRMSNorm", "Step3p7RMSNorm",
        "T5Gemma2RMSNorm", "T5GemmaRMSNorm", "VaultGemmaRMSNorm",
    ),
    GEMMA3N: (
        "DiffusionGemmaRMSNorm", "EmbeddingGemma2RMSNorm", "Gemma3nRMSNorm", "Gemma4RMSNorm", "Gemma4UnifiedRMSNorm",
        "MuseGlimmerRMSNorm", "MuseSparkRMSNorm", "NeoMMERMSNorm",
    ),
    T5: (
        "IdeficsRMSNorm", "Kosmos2_5LayerNorm", "LongT5LayerNorm", "MT5LayerNorm", "Pix2StructLayerNorm",
        "Pop2PianoLayerNorm", "SwitchTransformersLayerNorm", "T5LayerNorm", "UMT5LayerNorm", "UdopLayerNorm",
    ),
    COHERE: ("Cohere2LayerNorm", "Cohere2MoeLayerNorm", "CohereCompassLayerNorm", "CohereLayerNorm"),
    DEBERTA: ("DebertaLayerNorm",),
}
KNOWN: dict = {name: family for family, names in _CLASSES.items() for name in names}

Extra = Mapping[Union[type, str], NormFamily]


def lookup(module: torch.nn.Module, extra: Optional[Extra] = None) -> Optional[NormFamily]:
    """The family `module`'s class belongs to: `extra` first (by class, then by name), then the table;
    exactly `torch.nn.LayerNorm` / `torch.nn.RMSNorm` (not subclasses: they may change forward)."""
    cls = type(module)
    if extra:
        family = extra.get(cls) or extra.get(cls.__name__)
        if family is not None:
            return family
    if cls is torch.nn.LayerNorm:
        return TORCH_LAYER_NORM
    if cls is torch.nn.RMSNorm:
        return TORCH_RMS_NORM
    return KNOWN.get(cls.__name__)


def mismatch(module: torch.nn.Module, family: NormFamily) -> Optional[str]:
    """Why `module` does not have the structure `family` converts (None: it does)."""
    if type(module) in (torch.nn.LayerNorm, torch.nn.RMSNorm):
        # torch's own: converted from their constructor arguments; buffers move over (their forward reads none)
        return "has submodules, which the shardnorm module would not keep" \
            if next(module.children(), None) is not None else None
    if not getattr(module, "with_scale", True):
        return "has no weight (with_scale=False), so its normalized size is unknown"
    weight = module._parameters.get("weight")
    if not isinstance(weight, torch.nn.Parameter):
        return "has no `weight` Parameter"
    shape = tuple(getattr(weight, "ds_shape", weight.shape))  # ZeRO-3 keeps the full shape in ds_shape
    if len(shape) != 1:
        return (f"its weight has shape {list(shape)} (a scale per head); shardnorm's norms take a 1-D weight over "
                "the normalized dim")
    expected = {"weight", "bias"} if family.bias else {"weight"}
    present = {n for n, p in module._parameters.items() if p is not None}
    if present != expected:
        return f"has parameters {sorted(present)}, {family.name} norms have {sorted(expected)}"
    if family.bias and tuple(getattr(module.bias, "ds_shape", module.bias.shape)) != shape:
        return "its bias and weight differ in shape"
    if any(True for _ in module.children()) or any(b is not None for b in module._buffers.values()):
        return "has submodules or buffers, which the shardnorm module would not keep"
    eps = getattr(module, family.eps_attr, None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"has no float `{family.eps_attr}` (got {eps!r})"
    return None
