from django.db import migrations


def load_classes(apps, schema_editor):
    from serving.actions.gpu_classes import sync_gpu_classes

    sync_gpu_classes(apps.get_model("serving", "GpuClass"))


class Migration(migrations.Migration):
    dependencies = [("serving", "0003_fleet_nodes_replicas_telemetry")]

    operations = [migrations.RunPython(load_classes, migrations.RunPython.noop)]
