"""Models of the GPU fleet: GPU classes and pools (nodes, GPUs and replicas build on these)."""

from __future__ import annotations

from decimal import Decimal

from django.core.validators import MinValueValidator
from django.db import models


class GpuClass(models.Model):
    """A kind of GPU with its datasheet figures (loaded from serving/engine/data/gpus.csv)."""

    name = models.CharField(max_length=64, unique=True)
    memory_gb = models.FloatField()
    mem_bandwidth_gbs = models.FloatField()
    bf16_tflops = models.FloatField()
    fp8_tflops = models.FloatField(null=True, blank=True)
    tdp_w = models.PositiveIntegerField()
    default_usd_per_hour = models.DecimalField(max_digits=10, decimal_places=4)
    notes = models.TextField(blank=True)

    class Meta:
        ordering = ["-memory_gb", "name"]
        verbose_name_plural = "GPU classes"

    def __str__(self) -> str:
        return self.name


class GpuPool(models.Model):
    """A set of nodes with one GPU class in one region, priced per GPU-hour."""

    name = models.SlugField(max_length=64, unique=True)
    gpu_class = models.ForeignKey(GpuClass, on_delete=models.PROTECT, related_name="pools")
    region = models.CharField(max_length=64)
    usd_per_gpu_hour = models.DecimalField(
        max_digits=10,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0"))],
        help_text="Overrides the GPU class's default price when set.",
    )
    spot = models.BooleanField(default=False)
    labels = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def price_per_gpu_hour(self) -> Decimal:
        if self.usd_per_gpu_hour is not None:
            return self.usd_per_gpu_hour
        return self.gpu_class.default_usd_per_hour
