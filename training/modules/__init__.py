"""Lightning modules that train draft heads on a frozen target: one per head kind, over a shared base."""
from training.modules.base import DraftModule
from training.modules.dflash import DFlashModule
from training.modules.dspark import DSparkModule
from training.modules.eagle import EagleModule
from training.modules.eagle3 import Eagle3Module
from training.modules.medusa import MedusaModule
from training.modules.mtp import MtpModule
from training.modules.peagle import PeagleModule

MODULES = {cls.kind: cls for cls in (MedusaModule, EagleModule, Eagle3Module, MtpModule, PeagleModule, DFlashModule,
                                         DSparkModule)}

__all__ = ["MODULES", "DFlashModule", "DSparkModule", "DraftModule", "Eagle3Module", "EagleModule", "MedusaModule", "MtpModule",
           "PeagleModule"]
