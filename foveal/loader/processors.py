"""Hugging Face processors (image processor + tokenizer, and the processor's own settings) for a model
folder, through transformers' public API.

Owns: loading a folder's processor (AutoProcessor), and where its video half cannot load (transformers'
video processors need torchvision, a CPU-only box may lack it) the same processor without that half,
built from its parts; which image-processor class to build by name on such a box. Must not read
weights. Every saved setting is passed by name, never through an override of transformers' loading
path: a release that changes such a path must not be able to drop one (5.25 dropped SmolVLM's
`image_seq_len` from a path Foveal had overridden; tests/test_vlm_processors.py guards it).
"""

from __future__ import annotations

import inspect
import json
import logging
import os

from foveal.loader.errors import ModelLoadError

log = logging.getLogger(__name__)

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_hf_processor(path: str):
    """The model's transformers processor (image processor + tokenizer), or None for a text-only folder."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _PROCESSOR_FILES):
        return None
    reason = images_unsupported()
    if reason:
        raise ModelLoadError(f"cannot load the image processor of {path}: {reason}")
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        try:  # a processor whose video half needs torchvision (Qwen2-VL family) still serves images
            return _image_only_processor(path)
        except Exception:
            pass
        raise ModelLoadError(f"could not load the processor of {path}: {type(e).__name__}: {e}") from e


def load_video_config(path: str) -> dict | None:
    """The folder's video preprocessor settings, or None. transformers' own order: the video
    processor's file (video_preprocessor_config.json, or the "video_processor" part of
    processor_config.json), else the image processor's settings that older checkpoints share with
    video (preprocessor_config.json, or processor_config.json's "image_processor"). Read as plain
    values: transformers' video processors need torchvision to load, their settings do not."""

    def read(name: str) -> dict | None:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return None
        with open(file) as f:
            return json.load(f)

    nested = read("processor_config.json") or {}
    for found in (
        read("video_preprocessor_config.json"),
        nested.get("video_processor"),
        read("preprocessor_config.json"),
        nested.get("image_processor"),
    ):
        if isinstance(found, dict):
            return found
    return None


def images_unsupported() -> str | None:
    """Why this transformers cannot process images here, or None: before 5.18 its image processors
    (the Auto class and the PIL backends alike) load only with torchvision installed."""
    import transformers
    from packaging.version import Version
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or Version(transformers.__version__) >= Version("5.18"):
        return None
    return (
        f"transformers {transformers.__version__} loads image processors only with torchvision installed "
        "(install torchvision, or transformers >= 5.18)"
    )


def image_only_processor_class(cls):
    """`cls` (a transformers processor with image, video and tokenizer parts) without its video processor.

    transformers' video processors need torchvision, which a CPU-only box may lack; the image path does
    not. A processor's parts are the parameters of its `__init__` (that is how transformers finds them,
    to check, save and load them), so the subclass's signature simply drops one. It is only ever built
    through its constructor with every setting passed by name (`_image_only_processor` loads the parts
    and the saved settings through the public API): no loading path of transformers' is overridden, so
    a release that changes one cannot drop a setting on the way (transformers 5.25's `from_dict` did).
    `DropVideo` lets a class whose `__init__` passes its parts on in another order (Qwen2.5-Omni's: the
    video processor second, a feature extractor too) reach ProcessorMixin without the video part."""

    from transformers import ProcessorMixin

    parts = cls.get_attributes()  # the real class's parts, in the order its __init__ hands them on

    class DropVideo(ProcessorMixin):
        """Sits between `cls` and ProcessorMixin in the MRO: takes the parts as `cls.__init__` passes them
        on (positionally, in its own order: Qwen2.5-Omni puts the video processor second) and hands them
        to ProcessorMixin by name, less the video processor."""

        def __init__(self, *args, **kwargs):
            kwargs.update(zip(parts, args))
            kwargs.pop("video_processor", None)
            ProcessorMixin.__init__(self, **kwargs)

    class ImageOnly(cls, DropVideo):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            cls.__init__(
                self,
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=None,
                chat_template=chat_template,
                **kwargs,
            )

    # the real signature less the video processor: what transformers saves and checks parts by
    real = inspect.signature(cls.__init__)
    ImageOnly.__init__.__signature__ = real.replace(
        parameters=[p for p in real.parameters.values() if p.name != "video_processor"]
    )
    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__  # saved configs keep naming the real class
    return ImageOnly


_PARTS = ("image_processor", "tokenizer", "video_processor", "feature_extractor")


def _image_only_processor(path: str):
    """The folder's processor built from its parts, loaded one by one with transformers' Auto classes,
    and its own saved settings (SmolVLM's image_seq_len, ...) passed by name to the constructor."""
    import transformers
    from transformers import AutoImageProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        raise RuntimeError("torchvision is installed: the video processor is not what failed")
    name, settings = None, {}
    for f in _PROCESSOR_FILES:  # processor_config.json first: the processor's own settings live there
        if os.path.isfile(os.path.join(path, f)):
            with open(os.path.join(path, f)) as fh:
                data = json.load(fh)
            name = name or data.get("processor_class")
            if f == "processor_config.json":
                settings = data
    cls = getattr(transformers, name or "", None)
    if cls is None or "video_processor" not in inspect.signature(cls.__init__).parameters:
        raise RuntimeError("no processor class with a video processor to drop")
    log.warning("torchvision is not installed: %s will process images only (no video)", name)
    image_only = image_only_processor_class(cls)
    accepted = set(inspect.signature(image_only.__init__).parameters) - {"self", *_PARTS}
    kwargs = {k: v for k, v in settings.items() if k in accepted}
    template = os.path.join(path, "chat_template.json")  # the older layout; chat_template.jinja the newer
    if "chat_template" not in kwargs and os.path.isfile(template):
        with open(template) as fh:
            kwargs["chat_template"] = json.load(fh).get("chat_template")
    from foveal.loader.safetensors_loader import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(path)
    kwargs.setdefault("chat_template", getattr(tokenizer, "chat_template", None))
    if "feature_extractor" in inspect.signature(cls.__init__).parameters:  # Qwen2.5-Omni's audio half
        from transformers import AutoFeatureExtractor

        kwargs["feature_extractor"] = AutoFeatureExtractor.from_pretrained(path, trust_remote_code=False)
    return image_only(
        image_processor=AutoImageProcessor.from_pretrained(path, trust_remote_code=False),
        tokenizer=tokenizer,
        **kwargs,
    )


def image_processor_class(name: str):
    """transformers' image processor `name` (e.g. "SmolVLMImageProcessor"), as its PIL backend
    (`<name>Pil`) when torchvision is missing and the release has one: from 5.18 on the plain name is
    the torchvision backend (5.25 falls back by itself, 5.17-5.24 raise)."""
    import transformers
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available() and hasattr(transformers, name + "Pil"):
        return getattr(transformers, name + "Pil")
    return getattr(transformers, name)
