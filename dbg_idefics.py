import os, sys, tempfile, torch
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.getcwd())
from tests.tiny_vlm import build, image
from foveal.config import EngineConfig
from foveal.engine.engine import Engine
for fam in ["idefics3", "qwen2_vl"]:
    d = tempfile.mkdtemp()
    tiny = build(fam, d)
    eng = Engine(EngineConfig.from_kwargs(model=d, dtype="float32", device="cpu", num_blocks=256, block_size=4)).start()
    text = f"<|user|>{tiny.image_text}What?\n<|assistant|>"
    imgs = [image(40, 30, 1)]
    ref = tiny.processor(text=[text], images=[imgs] if fam == "idefics3" else imgs, return_tensors="pt")
    mine = eng.mm_processor.processor(text=[text], images=[imgs] if fam == "idefics3" else imgs, return_tensors="pt")
    print(fam, type(tiny.processor.image_processor).__name__, type(eng.mm_processor.processor.image_processor).__name__)
    for k in ref:
        a, b = ref[k], mine.get(k)
        print(" ", k, tuple(a.shape), None if b is None else tuple(b.shape), None if b is None or a.shape != b.shape else (a.float() - b.float()).abs().max().item())
    print("  ip ref:", tiny.processor.image_processor.to_dict())
    print("  ip mine:", eng.mm_processor.processor.image_processor.to_dict())
    if fam == "idefics3":
        pv = ref["pixel_values"]
        print("  crops", pv.shape, [(c != 0).any().item() for c in pv[0]])
        with torch.no_grad():
            hf = tiny.hf.model.get_image_features(pixel_values=ref["pixel_values"], pixel_attention_mask=ref.get("pixel_attention_mask"))
            hf = getattr(hf, "pooler_output", hf)
            p = eng.process_images(prompt=text, images=imgs)
            ours = eng.model.encode_images([it.data for it in p.items])
        hf = torch.cat(list(hf)) if isinstance(hf, (list, tuple)) else hf.reshape(-1, hf.shape[-1])
        print("  enc", hf.shape, ours[0].shape, (hf.reshape(-1, hf.shape[-1]) - ours[0]).abs().max().item() if hf.numel() == ours[0].numel() else "size mismatch")
