from django.db import migrations


def load_gpu_classes(apps, schema_editor):
    from serving.actions.gpu_classes import sync_gpu_classes

    sync_gpu_classes(apps.get_model("serving", "GpuClass"))


class Migration(migrations.Migration):
    dependencies = [("serving", "0001_gpu_classes_and_pools")]

    operations = [migrations.RunPython(load_gpu_classes, migrations.RunPython.noop)]
