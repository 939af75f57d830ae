"""Record -> Sample: the template rendered and tokenized with each image's run in place (``sample_builder``,
``conversation_ids``), images counted from their headers for planning (``header_images``), and the
stream of samples built in DataLoader workers for the store (``stream``).
"""

from neva_pack.samples.header_images import HeaderImage, HeaderImages
from neva_pack.samples.sample_builder import Sample, SampleBuilder, SampleLayout, Skipped, truncation
from neva_pack.samples.stream import SampleStream, received

__all__ = [
    "HeaderImage",
    "HeaderImages",
    "Sample",
    "SampleBuilder",
    "SampleLayout",
    "SampleStream",
    "Skipped",
    "received",
    "truncation",
]
