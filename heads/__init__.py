"""Draft heads (Medusa, EAGLE-1, EAGLE-3, MTP, P-EAGLE, DFlash, DSpark) and their checkpoint format: pure torch + safetensors, the
contract between training and serving."""
from heads.checkpoint import load, save
from heads.config import FORMAT_VERSION, HeadConfig
from heads.dflash import DFlash, DFlashConfig
from heads.draft_head import DraftHead
from heads.dspark import DSpark, DSparkConfig
from heads.eagle import Eagle, EagleConfig
from heads.eagle3 import Eagle3, Eagle3Config
from heads.medusa import Medusa, MedusaConfig
from heads.mtp import Mtp, MtpConfig
from heads.peagle import Peagle, PeagleConfig
from heads.target_parts import TargetParts, load_target_parts

__all__ = [
    "DFlash", "DFlashConfig", "FORMAT_VERSION", "DraftHead", "DSpark", "DSparkConfig", "Eagle", "Eagle3", "Eagle3Config", "EagleConfig", "HeadConfig",
    "Medusa", "MedusaConfig", "Mtp", "MtpConfig", "Peagle", "PeagleConfig", "TargetParts", "load", "load_target_parts",
    "save",
]
