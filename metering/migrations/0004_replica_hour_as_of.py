import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0003_replica_hour_ledger"),
    ]

    operations = [
        migrations.AddField(
            model_name="replicahour",
            name="as_of",
            field=models.DateTimeField(default=django.utils.timezone.now),
            preserve_default=False,
        ),
    ]
