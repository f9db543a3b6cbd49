"""Images: decoding, the checkpoint's image processor and the in-process faces (no torch).

* :func:`load_image` / :class:`ImageLimits`: bytes, files, ``data:`` URIs and PIL images in,
  RGB out, decoded as transformers' ``load_image`` decodes them (EXIF orientation included),
  hostile inputs refused with :class:`~ortbatch.errors.InvalidInputError` naming the limit.
* :class:`ImageProcessor`: the checkpoint's image processor (CLIP, SigLIP, ViT, DeiT, ConvNeXt,
  BiT/DINOv2, BEiT) in numpy and Pillow, equal to transformers' on the same image.
* :class:`ImageEmbedder` / :class:`ImageClassifier`: an image export's vectors (and a CLIP or
  SigLIP export's text vectors and zero-shot scores) or labels, batched through
  :class:`~ortbatch.BatchedSession` with the preprocessing on a thread pool.

Pillow is the ``vision`` extra (``pip install 'ortbatch[vision]'``), imported on first use.
"""

from .embedder import ImageClassifier, ImageEmbedder, normalize
from .images import DEFAULT_FORMATS, ImageLimits, load_image, load_images
from .processor import PROCESSOR_CLASSES, ImageProcessor

__all__ = [
    "ImageEmbedder",
    "ImageClassifier",
    "normalize",
    "DEFAULT_FORMATS",
    "ImageLimits",
    "ImageProcessor",
    "PROCESSOR_CLASSES",
    "load_image",
    "load_images",
]
