"""connmon: training-time monitoring of transformer attention read as a connection walk (arXiv 2607.10677).

Example:
    >>> import connmon
    >>> import connmon.functional as F
    >>> connmon.__version__
    '0.1.0'
"""

from connmon import callbacks, capture, functional
from connmon.analysis import Report, analyze
from connmon.capture import AttentionRecord

__version__ = "0.1.0"

__all__ = ["AttentionRecord", "Report", "__version__", "analyze", "callbacks", "capture", "functional"]
