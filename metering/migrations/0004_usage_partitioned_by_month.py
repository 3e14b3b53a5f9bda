"""Usage events partitioned by month of `started_at` (see metering.partitions): the table is
rebuilt as a partitioned one with its rows, then each month with rows gets its partition."""

from django.db import migrations
from django.utils import timezone

TO_PARTITIONED = """
CREATE TABLE metering_usageevent_new (LIKE metering_usageevent INCLUDING DEFAULTS)
    PARTITION BY RANGE (started_at);
CREATE TABLE metering_usageevent_new_default PARTITION OF metering_usageevent_new DEFAULT;
INSERT INTO metering_usageevent_new SELECT * FROM metering_usageevent;
DROP TABLE metering_usageevent;
ALTER TABLE metering_usageevent_new RENAME TO metering_usageevent;
ALTER TABLE metering_usageevent_new_default RENAME TO metering_usageevent_default;
ALTER TABLE metering_usageevent
    ADD CONSTRAINT metering_usageevent_pkey PRIMARY KEY (request_id, started_at);
CREATE INDEX usage_started_brin ON metering_usageevent USING brin (started_at);
CREATE INDEX usage_tenant_time ON metering_usageevent (tenant_id, started_at);
CREATE INDEX metering_usageevent_request_id_a5b3c4fa_like
    ON metering_usageevent (request_id varchar_pattern_ops);
"""

TO_PLAIN = """
CREATE TABLE metering_usageevent_old (LIKE metering_usageevent INCLUDING DEFAULTS);
INSERT INTO metering_usageevent_old SELECT * FROM metering_usageevent;
DROP TABLE metering_usageevent CASCADE;
ALTER TABLE metering_usageevent_old RENAME TO metering_usageevent;
ALTER TABLE metering_usageevent ADD CONSTRAINT metering_usageevent_pkey PRIMARY KEY (request_id);
CREATE INDEX usage_started_brin ON metering_usageevent USING brin (started_at);
CREATE INDEX usage_tenant_time ON metering_usageevent (tenant_id, started_at);
CREATE INDEX metering_usageevent_request_id_a5b3c4fa_like
    ON metering_usageevent (request_id varchar_pattern_ops);
"""


def create_partitions(apps, schema_editor):
    from metering import partitions

    partitions.ensure_partitions(timezone.now())


class Migration(migrations.Migration):
    dependencies = [("metering", "0003_usage_trace_id")]

    operations = [
        migrations.RunSQL(TO_PARTITIONED, TO_PLAIN),
        migrations.RunPython(create_partitions, migrations.RunPython.noop),
    ]
