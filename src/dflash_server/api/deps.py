"""Typed FastAPI dependencies: what a route needs from the app, declared in its signature."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from dflash_server.api.metrics import Metrics
from dflash_server.api.openai_responses import ResponseStore
from dflash_server.engine.models import ModelSet
from dflash_server.engine.worker import Engine
from dflash_server.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_models(request: Request) -> ModelSet:
    return request.app.state.models


def get_metrics(request: Request) -> Metrics | None:
    return request.app.state.metrics


def get_responses(request: Request) -> ResponseStore:
    return request.app.state.responses


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[Engine, Depends(get_engine)]
ModelsDep = Annotated[ModelSet, Depends(get_models)]
MetricsDep = Annotated[Metrics | None, Depends(get_metrics)]
ResponsesDep = Annotated[ResponseStore, Depends(get_responses)]
